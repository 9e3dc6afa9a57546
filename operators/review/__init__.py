"""Human verification (JL1-CC&QA stage 3): sampling, Label Studio tasks and config, and the summary of
the reviewers' verdicts. Pure cores (sampling, label_studio, agreement, summary) under thin I/O
(outputs, images; the Label Studio client is operators.labelstudio)."""
