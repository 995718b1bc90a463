"""The linear reference: a logistic regression per task on hand-made features, trained and
scored on a dataset's own splits, so a run's held-out NE and AUC can be read beside what a
simple model reaches on the same data."""
