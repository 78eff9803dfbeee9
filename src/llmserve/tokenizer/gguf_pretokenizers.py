"""The text splits ("pre-tokenizers") that llama.cpp applies before byte-level BPE (no torch).

A GGUF names its split in ``tokenizer.ggml.pre``. llama.cpp maps each name to an ordered list
of regular expressions; each expression splits every piece left by the previous ones into
its matches *and* the text between them (nothing is dropped). That is what a
``tokenizers`` ``Split(pattern, behavior="isolated")`` does, so a name becomes a
``Sequence`` of such splits followed by the GPT-2 byte mapping.

The patterns are the ones the models' own ``tokenizer.json`` files use (the case-insensitive
contractions written out as ``'[sS]`` ..., as llama.cpp does, so Unicode case folding cannot
widen them). :func:`pre_tokenizer_for` raises :class:`UnsupportedTokenizerError` naming any
name it does not know, instead of guessing a split that would silently tokenize differently
from the model's training.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers


class UnsupportedTokenizerError(ValueError):
    """The GGUF's tokenizer (model type or pre-tokenizer name) is one llmserve cannot build."""


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED_WORD = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+<c>"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*<c>")
_TEKKEN = (_CASED_WORD.replace("<c>", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (_CASED_WORD.replace("<c>", _CONTRACTIONS + "?") +
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PUNCT_WORD = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Non-ASCII classes are written as escapes: editors and copy/paste may NFC-normalise literal
# characters (U+212A KELVIN SIGN becomes "K"), which silently changes a range.
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_KANA_HAN = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_NO_PUNCT_WORD = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_DEEPSEEK_LLM_LATIN = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_YOUTU_CJK = ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a"
              "\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _KANA_HAN)
_AFMOE_ASIAN = ("[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
                "\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
                "\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+")
#: A digit run cut into groups of three counted from its end (the first group has 1-3 digits).
_DIGITS_FROM_RIGHT = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"


@dataclass(frozen=True)
class SplitRule:
    """How llama.cpp splits text for one family of pre-tokenizer names."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False      # a piece that is a whole vocabulary token is kept as is
    add_bos: bool = False            # llama.cpp's default when the GGUF has no add_bos_token


_RULES: dict[str, SplitRule] = {
    "default": SplitRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt2": SplitRule((_GPT2,)),
    "llama3": SplitRule((_LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": SplitRule((_LLAMA3,)),
    "chatglm": SplitRule((_LLAMA3,)),
    "glm4": SplitRule((_LLAMA3,), ignore_merges=True),
    "jais2": SplitRule((_LLAMA3.replace(r"|\s+(?!\S)|\s+", "") + "".join(
        rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}",)),
    "deepseek-llm": SplitRule((r"[\r\n]", _DEEPSEEK_LLM_LATIN, _DEEPSEEK_LLM_PUNCT,
                               r"\s+\z", _CJK, r"\p{N}+")),
    "deepseek-coder": SplitRule((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "deepseek-v3": SplitRule((r"\p{N}{1,3}", _KANA_HAN, _PUNCT_WORD)),
    "falcon": SplitRule((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "digits-gpt2": SplitRule((r"\p{N}", _GPT2)),
    "qwen2": SplitRule((_QWEN2,)),
    "qwen35": SplitRule((_QWEN35,)),
    "bloom": SplitRule((_NO_PUNCT_WORD,)),
    "viking": SplitRule((_NO_PUNCT_WORD, r"\p{N}")),
    "tekken": SplitRule((_TEKKEN,), ignore_merges=True, add_bos=True),
    "gpt4o": SplitRule((_GPT4O,)),
    "chameleon": SplitRule((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                            r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
                           add_bos=True),
    "tiny-aya": SplitRule((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O)),
    "superbpe": SplitRule((r"\p{N}+", r"\d{1,3}(?=(?:\d{3})*(?!\d))")),
    "bailingmoe": SplitRule((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+"
                             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "seed-coder": SplitRule((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                             r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "afmoe": SplitRule((_DIGITS_FROM_RIGHT,
                        _AFMOE_ASIAN, _PUNCT_WORD)),
    "exaone-moe": SplitRule((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+"
                             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "spark2-5": SplitRule((r"\p{N}{1,3}", _KANA_HAN, _PUNCT_WORD.replace(
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|", r"| ?[\p{P}\p{S}]+|[\r\n]|"), r"\p{N}")),
    "youtu": SplitRule((_YOUTU_CJK, _CASED_WORD.replace("<c>", _CONTRACTIONS + "?")
                        + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                       ignore_merges=True),
    "laguna": SplitRule((r"[^\n]+|[\n]+", _QWEN2)),
    "ufakzeka": SplitRule((_QWEN2[len(_CONTRACTIONS) + 1:],)),
    "granite-embed-multi": SplitRule((_GPT4O,), ignore_merges=True),
    "minicpm5": SplitRule((r"\p{N}{1,3}", _QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")),
                          ignore_merges=True),
}

#: ``tokenizer.ggml.pre`` name -> rule family (the names llama.cpp accepts for byte-level BPE).
PRE_TOKENIZER_NAMES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "dbrx"),
    "chatglm-bpe": "chatglm",
    **dict.fromkeys(("glm4", "glm5"), "glm4"),
    "jais-2": "jais2",
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), "deepseek-v3"),
    "falcon": "falcon",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b", "mellum2"), "digits-gpt2"),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais",
                     "trillion", "granite-docling", "exaone4", "jina-v1-en", "jina-v2-code",
                     "roberta-bpe"), "gpt2"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan",
                     "solar-open", "megrez", "grok-2"), "qwen2"),
    "qwen35": "qwen35",
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), "bloom"),
    "viking": "viking",
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    "chameleon": "chameleon",
    **dict.fromkeys(("tiny_aya", "cohere2moe"), "tiny-aya"),
    "superbpe": "superbpe",
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "seed-coder": "seed-coder",
    "afmoe": "afmoe",
    "exaone-moe": "exaone-moe",
    "minicpm5": "minicpm5",
    "spark2_5": "spark2-5",
    "youtu": "youtu",
    "laguna": "laguna",
    "ufakzeka": "ufakzeka",
    "granite-embed-multi-97m": "granite-embed-multi",
}


def split_rule_for(pre: str | None) -> SplitRule:
    """The split rule for a ``tokenizer.ggml.pre`` value (None: llama.cpp's ``default``).

    Raises:
        UnsupportedTokenizerError: the name is not one llmserve knows.
    """
    family = PRE_TOKENIZER_NAMES.get("default" if pre is None else pre)
    if family is None:
        raise UnsupportedTokenizerError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; known names: "
            f"{', '.join(sorted(PRE_TOKENIZER_NAMES))}")
    return _RULES[family]


def pre_tokenizer_for(rule: SplitRule) -> pre_tokenizers.PreTokenizer:
    """Regex splits of ``rule`` in order, then the GPT-2 byte-to-character mapping."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in rule.patterns]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
