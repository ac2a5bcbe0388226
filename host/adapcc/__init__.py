"""AdapCC-style scheduling: cost model, synthesizer, coordinator, profiler, executor (docs/adapcc.md)."""
