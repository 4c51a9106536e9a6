"""Bridges to HF transformers' ``DeepseekV4ForCausalLM`` (the reference implementation).

The parity suite runs the HF model on exactly the weights this package decodes:
:func:`hf_state_dict` turns an official-format checkpoint into the HF module
names and layouts (routed experts stacked per layer, ``gate_up_proj`` = w1
over w3), dequantised to float32.  transformers is imported only by callers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.loader import SafetensorsCheckpoint, WeightReader, expected_tensors, reference_to_hf_name
from ds4d.models.deepseek_v4.weights import ModelWeights


def hf_state_dict(path: str | Path) -> tuple[DeepseekV4Config, dict[str, torch.Tensor]]:
    cfg = DeepseekV4Config.from_file(path)
    reader = WeightReader(SafetensorsCheckpoint(path), cfg, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    for name in expected_tensors(cfg):
        if ".experts." in name and ".shared_experts." not in name:
            continue
        if name.endswith("tid2eid"):
            state[reference_to_hf_name(name)] = reader.index(name)
        else:
            state[reference_to_hf_name(name)] = reader.tensor(name)
    for layer in range(cfg.num_hidden_layers):
        experts = range(cfg.n_routed_experts)
        gate_up = [torch.cat([reader.expert(layer, e, "w1"), reader.expert(layer, e, "w3")]) for e in experts]
        prefix = f"model.layers.{layer}.mlp.experts."
        state[prefix + "gate_up_proj"] = torch.stack(gate_up)
        state[prefix + "down_proj"] = torch.stack([reader.expert(layer, e, "w2") for e in experts])
    reader.checkpoint.close()
    return cfg, state


def hf_model(path: str | Path):
    """An fp32 eager ``DeepseekV4ForCausalLM`` holding the checkpoint's decoded weights."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM

    cfg, state = hf_state_dict(path)
    hf_cfg = HFConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(hf_cfg).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def hf_model_from_tensors(
    cfg: DeepseekV4Config,
    issued: dict[str, torch.Tensor],
    weights: ModelWeights,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    experts_implementation: str | None = None,
):
    """An HF ``DeepseekV4ForCausalLM`` over the tensors ds4d's model already holds.

    ``issued`` maps reference names to the tensors the weights were built from
    (a :class:`~ds4d.models.deepseek_v4.random_init.RandomReader`'s record);
    the routed experts come from ``weights`` (float banks).  Tensors whose dtype
    HF keeps the same are shared, not copied, so both models fit on one GPU.
    """
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM

    hf_cfg = HFConfig(**cfg.to_hf_dict())
    options = {"dtype": dtype, "attn_implementation": "eager"}
    if experts_implementation:
        options["experts_implementation"] = experts_implementation
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM._from_config(hf_cfg, **options)
    wanted = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for name in expected_tensors(cfg):
        if ".experts." in name and ".shared_experts." not in name:
            continue
        state[reference_to_hf_name(name)] = issued[name]
    for layer, layer_weights in enumerate(weights.layers):
        gate_up, down = layer_weights.ffn.experts.dense()
        prefix = f"model.layers.{layer}.mlp.experts."
        state[prefix + "gate_up_proj"], state[prefix + "down_proj"] = gate_up, down
    unexpected = [k for k in state if k not in wanted]
    missing = [k for k in wanted if k not in state and "inv_freq" not in k]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, tensor in state.items():
        target = wanted[key]
        state[key] = tensor.to(device=device, dtype=target.dtype) if tensor.dtype != target.dtype else tensor
    model.load_state_dict(state, strict=False, assign=True)
    rotary = type(model.model.rotary_emb)  # computed tables, not in the state dict: build them on the device
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, rotary):
                with torch.device(device):
                    setattr(parent, child_name, rotary(hf_cfg))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"HF model tensors left unset: {left[:5]}")
    return model.eval()
