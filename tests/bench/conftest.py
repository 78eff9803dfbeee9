"""Fixtures for the benchmark tests: a small trained BPE tokenizer and the fake server."""
from __future__ import annotations

import random

import pytest

from llmserve.bench.workloads import TokenizersFileTokenizer
from tests.bench.bench_fake_server import ServerThread, make_app

_WORDS = ("the quick brown fox jumps over lazy dog serving tokens cache prefix batch "
          "latency throughput request stream model engine block query key value head "
          "layer scheduler memory queue kernel attention decode prefill sample").split()


@pytest.fixture(scope="session")
def bpe_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE (vocab 600) trained here on a small synthetic corpus, saved as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(1)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(30)) + ", 123 ok." for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def bpe_tokenizer(bpe_tokenizer_path: str) -> TokenizersFileTokenizer:
    return TokenizersFileTokenizer(bpe_tokenizer_path)


@pytest.fixture
def fake_server():
    """Factory: ``with fake_server(**make_app_kwargs) as srv`` serves on a free port."""

    def start(**kwargs) -> ServerThread:
        return ServerThread(make_app(**kwargs))

    return start
