"""Reading compiled programs: FLOPs and collective bytes (hlo), and repl.explain's StepReport."""
