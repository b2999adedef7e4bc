"""Reading compiled modules, and (later) cost formulas with their sources."""
