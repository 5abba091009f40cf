"""The prefill/decode layout an inference config asks for (`inference.disaggregation`): the two instances' KV roles,
the connectors whose KV travels as files, and the layout in words for the launchers' dry-run plans. The engine that
runs it is rlhpc/infer/engines/disagg.py; this module imports no vLLM, so launchers can describe it anywhere."""

from __future__ import annotations

from typing import List

from rlhpc.config.schema import InferenceConfig

PREFILL, DECODE = "kv_producer", "kv_consumer"
# Connectors that move KV through files in a folder (kv_connector_extra_config.shared_storage_path).
FILE_CONNECTORS = ("ExampleConnector",)


def describe(cfg: InferenceConfig) -> List[str]:
    """The P/D layout of one inference worker, for the launchers' dry-run plans."""
    pd = cfg.disaggregation
    if not pd.enabled:
        return []
    ptp = pd.prefill_tensor_parallel_size or cfg.tensor_parallel_size
    tp = cfg.tensor_parallel_size
    transport = ("KV files under <run_dir>/vllm/kv/" if pd.connector in FILE_CONNECTORS
                 else f"kv_buffer_device {pd.kv_buffer_device}")
    return [
        f"  prefill/decode disaggregation: each inference worker = 1 prefill + 1 decode vLLM instance "
        f"({ptp + tp} GPU(s)/worker)",
        f"    prefill instance: kv_role {PREFILL}, tensor_parallel_size {ptp}, GPUs [0, {ptp}) of the worker",
        f"    decode instance:  kv_role {DECODE}, tensor_parallel_size {tp}, GPUs [{ptp}, {ptp + tp}) of the worker",
        f"    KV connector: {pd.connector} ({transport}); prompts prefill on the first, completions decode on the second",
    ]
