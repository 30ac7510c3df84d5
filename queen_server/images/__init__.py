"""Image generation (issue 38): ``/v1/images/generations`` answered by workers with the
``image`` capability. ``orders`` resolves a request into the order a worker renders and prices
it by the queen's own count; ``delivery`` checks what a worker sends back before the client sees
it; ``links`` keeps the images of ``url`` answers for a limited time."""
