"""llmserve on Ray Serve (``llmserve serve-ray``, docs/SCALING.md "Ray Serve").

Engine replicas (an AsyncLLM each) are a Ray Serve deployment behind one ingress that
serves the OpenAI app and runs the gateway once; llmserve's prefix-aware policy is the
deployment's custom request router. Ray is an optional dependency (``llmserve[ray]``);
only this package imports it, and only when used.

From a ``serve run`` config::

    applications:
      - name: llmserve
        route_prefix: /
        import_path: llmserve.integrations.ray_serve:build_app
        args: {model: /models/m, num_replicas: 2, routing: prefix}
"""
from __future__ import annotations

from typing import Any, Mapping, Optional


def build_app(args: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> Any:
    """The Ray Serve application for ``serve-ray`` options (see ``.app.build_app``); a
    ValueError says how to install Ray when it is missing."""
    from llmserve.integrations.ray_serve.cli import require_ray

    require_ray()
    from llmserve.integrations.ray_serve.app import build_app as build

    return build(args, **kwargs)


__all__ = ["build_app"]
