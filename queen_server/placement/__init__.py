"""Models on demand (issue 17): resolving a model no worker holds, placing it on workers that fit
it, what a developer is told while it loads, and the demand the queen tells its workers of."""
