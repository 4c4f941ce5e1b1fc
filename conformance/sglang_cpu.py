"""SGLang's own model classes on CPU, without its server or scheduler.

World size 1 over gloo (SGLang's test utility), the torch-native attention backend
over a CPU KV pool, and one hand-built ForwardBatch per forward pass. Imported only
in the conformance environment (see Makefile: `make conformance`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import sglang.srt.layers.rotary_embedding.base as rotary_base
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
    configure_aux_hidden_state_capture,
)
from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from sglang.srt.runtime_context import get_context
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput
from sglang.srt.utils.hf_transformers import get_config
from sglang.test.layer_ut_utils import init_single_process_dist
from transformers import PretrainedConfig

from specsplit.ports import free_port

SGLANG_VERSION = "0.5.23"

# Our names for the forward passes compared, and SGLang's mode for each.
MODES = {
    "prefill": ForwardMode.EXTEND,  # SGLang computes the last token's logits only
    "verify": ForwardMode.TARGET_VERIFY,  # a chain of draft tokens: logits for every token
    "decode": ForwardMode.DECODE,
    "draft_extend": ForwardMode.DRAFT_EXTEND_V2,  # the head over target features: logits for every token
}


def start_sglang_on_cpu() -> None:
    """Once per process, before any SGLang model is built."""
    init_single_process_dist(master_port=free_port(), backend="gloo")
    # The rotary embedding picks its kernel when built: off CUDA, unless it believes it runs
    # on CPU, it imports vllm's. SGLANG_USE_CPU_ENGINE=1 would say so, but it also makes the
    # KV pool import sgl_kernel's CPU ops, which cannot load without a GPU. So only the rotary
    # module is told it runs on CPU; it then takes its native torch path.
    rotary_base._is_cpu = True
    get_context().override_server_args(attention_backend="torch_native", device="cpu",
                                       tp_size=1, pp_size=1, dp_size=1).install()


def _hf_config(model_dir: Path) -> PretrainedConfig:
    return get_config(str(model_dir), trust_remote_code=False)


def _weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    return safetensors_weights_iterator([str(p) for p in sorted(model_dir.glob("*.safetensors"))])


def load_target(model_dir: Path) -> torch.nn.Module:
    """SGLang's LlamaForCausalLM with the checkpoint loaded by its own load_weights."""
    model = LlamaForCausalLM(_hf_config(model_dir)).eval()
    model.load_weights(_weights(model_dir))
    return model


def head_aux_layer_ids(head_dir: Path) -> list[int] | None:
    """The capture ids as SGLang's model runner reads them from a head's config (None: its default)."""
    eagle = getattr(_hf_config(head_dir), "eagle_config", None) or {}
    return eagle.get("eagle_aux_hidden_state_layer_ids")


def set_capture(target: torch.nn.Module, layer_ids: list[int] | None) -> None:
    """EAGLE-3 capture as SGLang's model runner sets it up (it calls set_eagle3_layers_to_capture)."""
    configure_aux_hidden_state_capture(model=target, eagle_use_aux_hidden_state=True,
                                       eagle_aux_hidden_state_layer_ids=layer_ids,
                                       dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None,
                                       is_dspark=False)


def load_head(head_dir: Path, target: torch.nn.Module) -> torch.nn.Module:
    """SGLang's LlamaForCausalLMEagle3; like its EAGLE worker, it takes the target's embedding."""
    head = LlamaForCausalLMEagle3(_hf_config(head_dir)).eval()
    head.load_weights(_weights(head_dir))
    head.set_embed(target.get_embed())
    return head


class SGLangSequence:
    """One request in SGLang's CPU pools; each call to forward is one forward pass of `model`."""

    def __init__(self, model: torch.nn.Module, max_len: int) -> None:
        cfg = model.config
        self.model = model
        self.req_to_token = ReqToTokenPool(size=1, max_context_len=max_len, device="cpu", enable_memory_saver=False)
        self.kv = MHATokenToKVPool(size=max_len + 1, page_size=1, dtype=torch.float32,
                                   head_num=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                   layer_num=cfg.num_hidden_layers, device="cpu", enable_memory_saver=False,
                                   enable_alt_stream=False)
        self.row = self.req_to_token.alloc_rows(1)[0]
        # KV slot 0 is SGLang's padding slot: position p lives in slot p + 1
        self.req_to_token.write(self.row, torch.arange(1, max_len + 1, dtype=torch.int32))
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token, token_to_kv_pool=self.kv)
        self.backend = TorchNativeAttnBackend(runner)

    @torch.no_grad()
    def forward(self, mode: str, tokens: torch.Tensor, start: int,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens at positions start.. -> (logits, hidden states captured in full: a target's aux
        states, a head's pre-norm states). `hidden` is a head's input, carried as EAGLE draft input."""
        fmode, n = MODES[mode], tokens.shape[0]
        end = start + n
        batch = ForwardBatch(forward_mode=fmode, batch_size=1, input_ids=tokens.long(),
                             req_pool_indices=torch.tensor([self.row]), seq_lens=torch.tensor([end]),
                             seq_lens_cpu=torch.tensor([end]), out_cache_loc=torch.arange(start + 1, end + 1),
                             seq_lens_sum=end, positions=torch.arange(start, end))
        if fmode != ForwardMode.DECODE:
            batch.extend_prefix_lens, batch.extend_prefix_lens_cpu = torch.tensor([start]), [start]
            batch.extend_seq_lens, batch.extend_seq_lens_cpu = torch.tensor([n]), [n]
            batch.extend_start_loc, batch.extend_num_tokens = torch.tensor([0]), n
        batch.capture_hidden_mode = CaptureHiddenMode.FULL
        if hidden is not None:
            cls = EagleDraftExtendInput if fmode == ForwardMode.DRAFT_EXTEND_V2 else EagleDraftInput
            batch.spec_info = cls(hidden_states=hidden, capture_hidden_mode=CaptureHiddenMode.FULL)
        batch.req_to_token_pool, batch.token_to_kv_pool, batch.attn_backend = self.req_to_token, self.kv, self.backend
        with forward_context(ForwardContext(attn_backend=self.backend)):
            self.backend.init_forward_metadata(batch)
            out = self.model(batch.input_ids, batch.positions, batch)
        return out.next_token_logits.float(), out.hidden_states.float()
