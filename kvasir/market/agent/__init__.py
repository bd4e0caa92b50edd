"""The market's node half: the client, the window choice, enrollment (which drives a Stage and a Node), publishing."""
