"""A toy-world variant with sampling defaults in its generation_config.json leaves the world it copies untouched."""

from __future__ import annotations

import json

from asyncgrpo.toy.world import ToyWorld, ToyWorldSpec, with_generation_defaults


def test_generation_defaults_variant_is_a_sibling_copy_and_the_world_is_untouched(tmp_path):
    root = tmp_path / f"toy-{ToyWorldSpec().key()}"
    (root / "model").mkdir(parents=True)
    (root / "model" / "generation_config.json").write_text('{"eos_token_id": 0}')
    (root / "model" / "model.safetensors").write_bytes(b"weights")
    world = ToyWorld(root=root, model_dir=root / "model", train_file=root / "train.jsonl",
                     heldout_file=root / "heldout.jsonl", base_accuracy=0.2, base_sampled_accuracy=0.3,
                     spec=ToyWorldSpec())

    variant = with_generation_defaults(world)

    assert json.loads((variant.model_dir / "generation_config.json").read_text()) == \
        {"eos_token_id": 0, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True}
    assert (variant.model_dir / "model.safetensors").read_bytes() == b"weights"
    assert variant.model_dir.parent.parent == tmp_path and variant.model_dir.parent != root
    assert (variant.train_file, variant.spec.key()) == (world.train_file, ToyWorldSpec().key())
    assert (root / "model" / "generation_config.json").read_text() == '{"eos_token_id": 0}'  # the world's own
    assert with_generation_defaults(world, {"top_k": 5}).model_dir != variant.model_dir
    assert with_generation_defaults(world).model_dir == variant.model_dir  # built once, then found
