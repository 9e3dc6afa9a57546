"""Change labels: the annotators' label maps and their merge into one change map."""
