"""The contracts between the HTTP server, the gateway and the engine (no torch, no HTTP
framework): what the server may call on an engine (:mod:`~.engine_client`), how a gateway
joins the request path (:mod:`~.gateway_hook`), the error both answer with
(:mod:`~.errors`) and the connection limits a gateway config may set
(:mod:`~.server_limits`). The server and the gateway import these modules, never each
other's internals.
"""
