"""What a check leaves behind for people: `ttrace report` (text), report.html (html), the MLflow run
(tracking), and `ttrace bugs` (catalog)."""
