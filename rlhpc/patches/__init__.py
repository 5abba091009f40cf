"""Every change rlhpc makes to a library's code or globals: the list, with the versions checked (registry.py), vLLM's
(vllm.py) and the small ones of other libraries (libraries.py)."""
