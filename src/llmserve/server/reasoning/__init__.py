"""Reasoning models: parsers that split the think block from the answer. No torch."""
