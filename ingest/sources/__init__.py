"""Source adapters (Kafka)."""
