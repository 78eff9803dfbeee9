"""Suite-wide defaults: engines run eagerly unless a test asks for the compiled step.

Compiling a model takes seconds to minutes; the tests that cover the compiled decode step
pass ``enforce_eager=False`` explicitly (tests/model/executor/test_compiled_step.py). Subprocess
servers inherit the variable.
"""
import os

os.environ.setdefault("LLMSERVE_ENFORCE_EAGER", "1")
