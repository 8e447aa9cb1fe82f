"""loco's application layer: config -> running job."""
