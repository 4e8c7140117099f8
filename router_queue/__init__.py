"""router-queue: queued delivery of AI model runs (the Flask front door)."""
