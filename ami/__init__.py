"""EC2 Image Builder components, their scripts and the GPU / Neuron image recipes (see ``ami.recipes``)."""
