"""The experiments behind `flashkit demo|memory|bench|break-it|train`: each module measures one
thing, prints a table, and writes JSON/CSV (and PNG plots when matplotlib is installed)."""
