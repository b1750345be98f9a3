"""Command-line flags of a tiny model, so that ``petfunc train`` runs take seconds."""

TINY = [
    "--set",
    "architecture.model.d_pet=8",
    "--set",
    "architecture.model.d_head=8",
    "--set",
    "architecture.model.d_node=8",
    "--set",
    "architecture.model.d_feedforward=8",
    "--set",
    "architecture.model.num_heads=2",
    "--set",
    "architecture.model.num_gnn_layers=1",
    "--set",
    "architecture.model.cutoff=3.0",
    "--batch-size",
    "4",
    "--no-progress",
]
