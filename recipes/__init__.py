"""Built-in recipes: one declarative TOML file per model family (guide for recipe authors: adding-an-architecture.md, shipped beside them)."""
