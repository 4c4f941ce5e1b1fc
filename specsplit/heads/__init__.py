"""Trained EAGLE-3 heads shipped with the package (SGLang / SpecForge format); resolved by name
in specsplit.checkpoints.eagle_head (`--head smollm2-eagle3`, or `--head default`)."""
