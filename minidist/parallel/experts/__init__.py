"""Expert parallelism: an MoE block's experts split over a group, tokens moved by all-to-all."""
