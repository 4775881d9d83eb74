"""Learning (floor 1): the building blocks of training one model on one client: sample statistics (Eq. 6-7), losses
(Eq. 9-16), models (f = g . h), Eq. 2's weighted average, what a client holds, accuracy, confusion counts and the
model file."""
