"""Models and tokenizers: built in code for tests and the quick start, loaded from Hugging Face folders otherwise.

A built model is saved in Hugging Face format and then loaded back with `from_pretrained`, so the quick start takes the
same loading path as a real checkpoint.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Optional, Set

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from rlhpc.config.schema import ModelConfig
from rlhpc.modeling.dtypes import dtype_of

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
    from transformers import CONFIG_MAPPING

    if cfg.arch not in CONFIG_MAPPING:
        close = difflib.get_close_matches(cfg.arch, list(CONFIG_MAPPING.keys()), n=3)
        raise ValueError(f"config key `model.arch`: {cfg.arch!r} is not a transformers model type"
                         + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    return AutoConfig.for_model(cfg.arch, **keys)


# A model built in code is also run on a few tokens by `built_model_problem` when it has at most this many parameters
# (a larger one is only constructed, on the meta device: building it would take seconds).
_RUN_CHECK_PARAMS = 50_000_000


def built_model_problem(cfg: ModelConfig) -> Optional[str]:
    """Why the model that `cfg` builds in code (no `model.path`) cannot work, naming the key; None if it builds and
    runs. Every key of `model.extra` must be a setting of `model.arch`'s transformers config: transformers keeps an
    unknown key without a word, so a misspelt `num_expert` would quietly build a dense model. The model is then built
    on the meta device and, when small, for real and run on a few tokens: sizes that do not fit together (a head_dim
    that rotary embeddings cannot split, say) fail here, before any role starts, instead of in every role."""
    tokenizer = build_tokenizer(cfg.tokenizer_merges, cfg.tokenizer_added_tokens, cfg.tokenizer_corpus)
    try:
        hf_config = _arch_config(cfg, len(tokenizer), tokenizer)
    except ValueError as e:
        return str(e) if str(e).startswith("config key") else f"config key `model.extra`: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - a value of the wrong type that the config class rejects
        return f"config key `model.extra`: {type(e).__name__}: {e}"
    known, built = config_settings(type(hf_config)), hf_config.to_dict()
    for key in sorted(set(cfg.extra) - known):
        # A legacy key the config converts (rope_theta goes into rope_parameters) changes more than itself.
        without = _arch_config(replace(cfg, extra={k: v for k, v in cfg.extra.items() if k != key}), len(tokenizer),
                               tokenizer).to_dict()
        if any(without.get(k) != built.get(k) for k in set(built) | set(without) if k != key):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=2, cutoff=0.7)
        hint = f" (did you mean {' or '.join(f'`model.extra.{c}`' for c in close)}?)" if close else ""
        return (f"config key `model.extra.{key}`: not a setting of transformers' {cfg.arch} config, which would "
                f"ignore it{hint}")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        if sum(p.numel() for p in model.parameters()) <= _RUN_CHECK_PARAMS:
            with torch.random.fork_rng():
                model = AutoModelForCausalLM.from_config(hf_config)
            n = min(8, cfg.max_position_embeddings)
            with torch.no_grad():
                model(torch.arange(n).unsqueeze(0) % hf_config.vocab_size)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, its message is what the user needs
        text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        return (f"config key `model`: the {cfg.arch} model built from model.*'s sizes and model.extra does not run: "
                f"{type(e).__name__}: {text}")
    return None


def config_settings(cls: type) -> Set[str]:
    """The settings a transformers config class knows: its constructor's arguments, its defaults' keys and its
    aliases (attribute_map)."""
    params = {n for n, p in inspect.signature(cls.__init__).parameters.items()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    return params | set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))


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


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks of a Hugging Face causal LM (model.model.layers for Qwen3, Qwen3-MoE, GLM-5, MiniMax-M2,
    DeepSeek...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no `model.layers` to shard per block")
    return layers
