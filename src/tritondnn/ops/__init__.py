"""One module (or folder) per primitive family; each follows the template in ARCHITECTURE.md."""
