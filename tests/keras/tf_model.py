"""A small CNN built by Keras under whichever backend imports this (the TensorFlow one in
`test_keras.py`'s subprocess)."""


def cnn():
    import keras

    keras.utils.set_random_seed(3)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, name="conv1")(inp)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.DepthwiseConv2D(3, name="dw")(keras.layers.ReLU()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(x), name="tfcnn")
