"""mixprec inside the trainers people use: each integration is an optional extra,
imported only by name (``from mixprec.integrations.lightning import MixprecPrecision``)."""
