"""One click command per DVC stage: read params.yaml, call fedccrl_core, write the declared outputs."""
