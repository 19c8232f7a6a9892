"""mossvox: stages layer."""
