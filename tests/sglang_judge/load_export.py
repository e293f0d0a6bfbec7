"""Load an export with SGLang 0.5.23's own LlamaForCausalLMEagle3 on the CPU; save what it holds.

    python load_export.py EXPORT_DIR OUT.pt

Builds the real model class from the export's config.json (a world of one, gloo), feeds
`model.safetensors` through its real `load_weights`, and saves every parameter plus
`hot_token_id` (SGLang's draft-to-target map) with torch.save.
"""

import os
import sys
import tempfile

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU code paths (rotary embedding) instead of CUDA kernels
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import native_stubs  # noqa: E402,F401


def main(export_dir: str, out: str) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    get_context().set_server_args(ServerArgs(model_path=export_dir, device="cpu"))
    rendezvous = tempfile.mktemp(prefix="sglang-judge-")
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"file://{rendezvous}")
    parallel_state.initialize_model_parallel(backend="gloo")
    get_parallel().override_permanently(tp_rank=0, tp_size=1)
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    config = AutoConfig.from_pretrained(export_dir)
    model = LlamaForCausalLMEagle3(config)
    model.load_weights(iter(load_file(os.path.join(export_dir, "model.safetensors")).items()))
    state = {name: param.detach().clone() for name, param in model.named_parameters()}
    torch.save({"params": state, "hot_token_id": model.hot_token_id}, out)
    print("loaded", len(state))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
