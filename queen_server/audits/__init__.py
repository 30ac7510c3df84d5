"""Catching cheating workers: re-scoring audits and the rule that flags a worker (issue 16).
``decision.py`` is the pure rule; the audit service that samples jobs, sends ``score`` jobs to
auditors and acts on flags comes next."""
