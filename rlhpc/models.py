"""Models and tokenizers: built in code for tests and the quick start, loaded from Hugging Face folders otherwise.

A built model is saved in Hugging Face format and then loaded back with `from_pretrained`, so the quick start takes the
same loading path as a real checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from rlhpc.config import ModelConfig
from rlhpc.dtypes import dtype_of

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-style chat template: what the assistant says ends with <|im_end|>, which is also the tokenizer's eos token.
# Tools (`tools=`) are listed compactly in a system turn, as `name(arg, ...): description`, to keep a tiny model's
# prompts short; the policy calls them as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (rlhpc.env.tools).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}{% set f = t['function'] if 'function' in t else t %}"
    "{{ '\\n- ' }}{{ f['name'] }}({{ (f['parameters']['properties'] if 'parameters' in f and 'properties' in f['parameters'] "
    "else {}) | join(', ') }}): {{ f['description'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The few merges of the built tokenizer come from the chat roles only, so ordinary text stays close to byte level.
_MERGE_CORPUS = ["user", "assistant", "system"]


def build_tokenizer(merges: int = 16, added_tokens=(), corpus=()) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(SPECIAL_TOKENS) + merges,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_MERGE_CORPUS + list(corpus)) * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    if added_tokens:
        fast.add_tokens(list(added_tokens))
    return fast


def _arch_config(cfg: ModelConfig, vocab_size: int, tokenizer: PreTrainedTokenizerFast) -> Any:
    keys: Dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    keys.update(cfg.extra)
    try:
        return AutoConfig.for_model(cfg.arch, **keys)
    except ValueError as e:
        raise ValueError(f"config key `model.arch`: {cfg.arch!r} is not a transformers model type ({e})") from e


def build(cfg: ModelConfig, out_dir: Path) -> Path:
    """Builds the tiny model and tokenizer of `cfg` with its seed and saves both in Hugging Face format."""
    tokenizer = build_tokenizer(cfg.tokenizer_merges, cfg.tokenizer_added_tokens, cfg.tokenizer_corpus)
    hf_config = _arch_config(cfg, len(tokenizer), tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    log.info("built %s (%s, %.2fM parameters) in %s", cfg.name, cfg.arch, n / 1e6, out_dir)
    return out_dir


def load_model(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} holds no Hugging Face checkpoint (no config.json); check `model.path`")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype_of(dtype))
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def copy_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """The top-level files of the Hugging Face folder `src` (config, safetensors, tokenizer) copied into `dst`, without
    loading the model. Copies, not links: nothing written later into `dst` can reach the user's checkpoint."""
    import shutil

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src} holds no Hugging Face checkpoint (no config.json); check `model.path`")
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        shutil.copyfile(f, dst / f.name)
    return dst
