"""The ``extractive`` benchmark workload: long passages with an instruction to repeat,
correct or reformat them, so most of the answer is a copy of the prompt.

This is where prompt-lookup speculation shines (quoting, rewriting, editing code,
summarising with copying). Passages are seeded sentences of common English words; a few
words are misspelled (a swapped letter pair) so "correct" has something to fix. The
output length asked for is the passage's token count plus a small margin.
"""
from __future__ import annotations

import random
from typing import Any

_WORDS = (
    "the city river morning light people market small house garden old road winter "
    "summer station train window evening music table letter friend story water bridge "
    "village mountain forest teacher school children book paper history language music "
    "company report office meeting project plan budget team customer product service "
    "system network server request data memory engine model number value result test "
    "open close walk carry build write read find keep bring follow change remember "
    "quiet bright careful simple early late warm cold green blue heavy quick slow").split()
_INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word.",
    "Correct the spelling mistakes in the following passage and return the whole "
    "corrected passage.",
    "Rewrite the following passage with one sentence per line, keeping every word.",
)


def _passage(rng: random.Random, num_words: int, typo_rate: float = 0.03) -> str:
    sentences, words = [], 0
    while words < num_words:
        n = rng.randint(8, 16)
        sent = [rng.choice(_WORDS) for _ in range(n)]
        for i, w in enumerate(sent):
            if len(w) > 3 and rng.random() < typo_rate:
                j = rng.randrange(len(w) - 1)
                sent[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
        sentences.append(" ".join(sent).capitalize() + ".")
        words += n
    return " ".join(sentences)


def extractive_workload(tokenizer: Any, num_prompts: int, input_len: int,
                        seed: int = 0) -> list:
    """``num_prompts`` passages of about ``input_len`` tokens each, with an instruction
    cycling over repeat / correct / reformat; output length = passage tokens + 16."""
    from llmserve.bench.workloads import RequestSpec, _check_counts

    _check_counts(num_prompts=num_prompts, input_len=input_len)
    rng = random.Random(seed)
    specs = []
    for i in range(num_prompts):
        words = max(8, int(input_len * 0.75))
        passage = _passage(rng, words)
        passage_tokens = len(tokenizer.encode(passage, add_special_tokens=False))
        instruction = _INSTRUCTIONS[i % len(_INSTRUCTIONS)]
        content = f"{instruction}\n\n{passage}"
        specs.append(RequestSpec(
            f"extractive-{i}", content, [{"role": "user", "content": content}],
            len(tokenizer.encode(content, add_special_tokens=False)), passage_tokens + 16,
            meta={"task": instruction.split()[0].lower()}))
    return specs
