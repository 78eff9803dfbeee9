"""LoRA adapters in the model runner: PEFT tensors (weights), slot-table layers (layers),
and the manager that maps each step's adapters to slots (manager). See docs/LORA.md."""
from llmserve.model.lora.layers import LoraLinear, LoraStepState
from llmserve.model.lora.manager import LoraManager

__all__ = ["LoraLinear", "LoraManager", "LoraStepState"]
