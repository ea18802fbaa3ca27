"""What the server reports about itself: Prometheus metrics and the garbage collector's pauses."""
