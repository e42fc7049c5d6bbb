"""What people and programs read: status.json, status.html, the terminal view, progress."""
