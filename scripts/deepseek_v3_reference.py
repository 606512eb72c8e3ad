#!/usr/bin/env python3
"""Reference logits of tiny DeepSeek-V3 checkpoints from HF transformers (fp32).

For each checkpoint folder (written by `deepinfer dev make-tiny`), runs HF's own
`DeepseekV3ForCausalLM` over a fixed prompt followed by 16 fixed decode tokens and HF's
`MtpModel` (the MTP "nextn" layer) over the same sequence, and writes
`<out>/<name>.safetensors` with:

  tokens      [T]       int64  the token ids (prompt then the decode tokens)
  prompt_len  [1]       int64
  logits      [T, V]    f32    main-model logits at every position
  hidden      [T, D]    f32    final-norm hidden states (the MTP layer's input)
  mtp_logits  [T-1, V]  f32    MTP logits: position i combines hidden[i] with token i+1

FP8 folders (`quantization_config.quant_method == "fp8"`) are dequantized here, independently
of the Rust loader (e4m3 value times its block's `weight_scale_inv`), into a temporary fp32
folder that HF then loads.

Usage: deepseek_v3_reference.py OUT_DIR CHECKPOINT_DIR...
Needs torch, transformers (>= 5.17, with `MtpModel`) and safetensors.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import MtpModel

PROMPT = [1, 75, 107, 104, 111, 111, 114, 35, 260, 87, 114, 117, 111, 103, 36, 2]
DECODE = [40, 261, 100, 73, 263, 5, 88, 150, 201, 13, 77, 262, 99, 230, 60, 7]


def dequantize_folder(src: Path, dst: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    block = cfg["quantization_config"]["weight_block_size"]
    del cfg["quantization_config"]
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name[: -len(".weight")] + ".weight_scale_inv"].float()
            rows, cols = t.shape
            s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
            out[name] = (t.float() * s).contiguous()
        else:
            out[name] = t.float()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        if (src / f).exists():
            shutil.copy(src / f, dst / f)


@torch.no_grad()
def reference(folder: Path) -> dict:
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    if info["missing_keys"] or info["mismatched_keys"]:
        raise SystemExit(f"{folder}: HF did not load every weight: {info}")
    model.eval()
    tokens = torch.tensor([PROMPT + DECODE])
    out = model(input_ids=tokens)
    hidden = model.model(input_ids=tokens).last_hidden_state
    # HF finds the MTP weights by the pattern of DeepSeek-V3's layer 61; ours sit after layer n
    n = model.config.num_hidden_layers
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    mtp = MtpModel.from_pretrained(model)
    mtp.eval()
    # the MTP layer's weights must be the checkpoint's, not a fresh init
    ckpt = load_file(str(folder / "model.safetensors"))
    for ours, theirs in [
        (mtp.layers[0].eh_proj.weight, ckpt[f"model.layers.{n}.eh_proj.weight"]),
        (mtp.layers[0].post_norm.weight, ckpt[f"model.layers.{n}.shared_head.norm.weight"]),
        (
            mtp.layers[0].mtp_block.self_attn.kv_b_proj.weight,
            ckpt[f"model.layers.{n}.self_attn.kv_b_proj.weight"],
        ),
    ]:
        assert torch.equal(ours, theirs.float()), "MTP weight not loaded from the checkpoint"
    ids = tokens[:, 1:]
    prev = hidden[:, :-1]
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    emb = mtp.embed_tokens(ids)
    pe = mtp.rotary_emb(emb, position_ids=pos)
    mask = create_causal_mask(
        config=mtp.config, inputs_embeds=emb, attention_mask=None, past_key_values=None, position_ids=pos
    )
    h = mtp.layers[0](emb, prev, position_embeddings=pe, attention_mask=mask, position_ids=pos, past_key_values=None)
    mtp_logits = mtp._project_to_logits(h)
    return {
        "tokens": tokens[0].to(torch.int64),
        "prompt_len": torch.tensor([len(PROMPT)], dtype=torch.int64),
        "logits": out.logits[0].float().contiguous(),
        "hidden": hidden[0].float().contiguous(),
        "mtp_logits": mtp_logits[0].float().contiguous(),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for arg in sys.argv[2:]:
        folder = Path(arg)
        cfg = json.loads((folder / "config.json").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            src = folder
            if "quantization_config" in cfg:
                src = Path(tmp) / "dequantized"
                dequantize_folder(folder, src)
            ref = reference(src)
        save_file(ref, str(out_dir / f"{folder.name}.safetensors"), metadata={
            "transformers": transformers.__version__, "torch": torch.__version__,
        })
        print(f"{folder.name}: logits {tuple(ref['logits'].shape)}, mtp {tuple(ref['mtp_logits'].shape)}")


if __name__ == "__main__":
    main()
