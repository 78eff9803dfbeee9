"""Set-up of the performance peers of ``llmserve bench compare`` (llama-server, vLLM CPU), run by ``make bench-peers``."""
