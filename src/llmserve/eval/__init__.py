"""``llmserve eval``: a quality gate for engine configurations (quantization, dtypes, KV).

Every configuration runs the same fixed text (``eval_text.txt``, shipped with the package)
and the same greedy prompts; a reference configuration (default: the same weights
dequantized to float32) supplies the yardstick. See :mod:`llmserve.eval.gate`.
"""
