"""Training-side code: data -> target-generated answers -> features -> draft heads."""
