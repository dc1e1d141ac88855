"""Training of Triptych's tiny default model (Qwen-Image family) on the procedural shape world.

``python -m training --out DIR --seed 0 [--resume]`` runs every stage (VAE, Qwen2.5-VL
captioner, Qwen-Image transformer), then writes the text-to-image and edit pipelines as diffusers
directories (``DIR/model``, ``DIR/model_edit``). See ``triptych/assets/default/MODEL_CARD.md``.
"""
