"""Run an exported EAGLE-3 directory through the speculators package's own loader and forward.

Runs in a separate environment that has `speculators` (it pins an older transformers than
specwise): see `python benchmarks/interop.py speculators-env`. Not imported by specwise.

    python scripts/speculators_probe.py DRAFT_DIR INPUTS.pt OUTPUT.pt

INPUTS.pt holds `hidden_states` [1, T, F*H] (the concatenated target taps), `input_ids` [1, T]
(the token after each position) and `ttt_steps`; OUTPUT.pt gets `logits`, one [1, T, Vd] tensor
per step (the draft vocabulary in the file's order) and `d2t`.
"""

import sys

import torch
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(draft_dir: str, inputs_path: str, output_path: str) -> None:
    inputs = torch.load(inputs_path, weights_only=True)
    config = Eagle3SpeculatorConfig.from_pretrained(draft_dir)
    # dense masks: the default flex attention wants sequence lengths in whole 128-token blocks on CPU
    config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    model = Eagle3DraftModel.from_pretrained(draft_dir, config=config, torch_dtype=torch.float64).eval()
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach().clone()))
    hidden = inputs["hidden_states"].to(torch.float64)
    with torch.no_grad():
        model(hidden_states=hidden, input_ids=inputs["input_ids"],
              document_ids=torch.zeros_like(inputs["input_ids"]), ttt_steps=int(inputs["ttt_steps"]))
    torch.save({"logits": captured, "d2t": getattr(model, "d2t", None),
                "layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or [])}, output_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
