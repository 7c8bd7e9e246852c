"""Context parallelism: the sequence split over a group; attention by a ring of K/V."""
