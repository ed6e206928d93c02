"""The Long Range Arena datasets: ListOps, IMDb text, CIFAR-10 image, Pathfinder / Path-X (with its image
generator) and AAN retrieval."""
