"""Built-in recipes: one declarative TOML file per model family (see docs/adding-an-architecture.md)."""
