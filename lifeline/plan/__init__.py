"""`lifeline plan`: the engine's own scheduler and KV manager driven by a simulated executor on
a virtual clock, with a roofline cost of each step on hardware from a catalog (docs/plan.md)."""
