"""Driver glue shared by several adapters of one backend (error translation, connection checks)."""
