"""What every family uses; knows no family."""
